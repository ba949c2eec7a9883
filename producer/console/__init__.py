"""The operations console: status of a run, and the tools for failed and queued jobs (retry-failed, cancel)."""
