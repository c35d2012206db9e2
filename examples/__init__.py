"""Example tasks; `task.entry: "examples.<module>:<function>"` in a job file imports them from here."""
