"""A plug-in module (a connector's module path, a medium, a container hook) that calls
``sys.exit()`` at import, quoting a secret: kvwire must report it, redacted, and go on."""

import sys

sys.exit("plugin settings from redis://u:hunter2-secret@h (password=hunter2-secret)")
