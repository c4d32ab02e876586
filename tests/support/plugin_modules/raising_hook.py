"""A container hook's module that raises at import, quoting a secret: the error must not."""

raise RuntimeError("hook settings from redis://u:hunter2-secret@h (password=hunter2-secret)")
