"""`drivetrain up`: a local fleet of edges, workers and routers as child processes, supervised."""
