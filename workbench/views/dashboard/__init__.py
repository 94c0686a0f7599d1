"""The Panel dashboard: `app` (the Viewer) over `state` (sessions and shared work)."""
