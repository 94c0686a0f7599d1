"""The Panel dashboard: `app` (the page and its tabs) over `tab` (the Tab protocol), `tab_state` (what each
computing tab owns: its state and job) and `state` (the session's sample, config and selection; shared work)."""
