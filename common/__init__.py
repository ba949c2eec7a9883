"""What the producer, the workers and the server tooling share: settings, keys, records, the output store."""
