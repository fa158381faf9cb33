"""Code only the tests use (a policy simulator, a report checker): kept out of the installed package."""
