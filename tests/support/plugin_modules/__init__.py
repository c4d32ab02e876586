"""Modules the tests name by their module path as plug-in code: importing one does
something (exits, raises, interrupts, takes long), so each stays a module of its own."""
