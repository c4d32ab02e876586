"""Helpers every part of kvwire uses: redaction, plug-in calls, optional extras, lazy exports."""
