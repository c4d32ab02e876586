"""A plug-in module that raises ``KeyboardInterrupt`` itself at import, with no Ctrl-C behind
it: kvwire must report it as the plug-in's failure, not stop as if the user had interrupted."""

raise KeyboardInterrupt("plugin gave up on redis://u:hunter2-secret@h")
