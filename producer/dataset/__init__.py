"""Completed outputs -> datasets: the export formats, the manifest beside them, and verify."""
