"""In-memory stand-ins for the parts of trioserve below the code under test: a scripted serving
core (``fakes.core``) and a worker client whose records a test scripts (``fakes.worker_client``).
No processes, no clock of their own."""
