"""What every process needs around the contract: settings, structured logs, health."""
