"""Turns dataset partitions into generation jobs, and completed outputs into datasets."""
