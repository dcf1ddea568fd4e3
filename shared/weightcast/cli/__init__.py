"""The ``weightcast`` command; daemons are imported only by the command that runs them."""
