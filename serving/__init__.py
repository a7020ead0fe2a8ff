"""Requests, scheduler, model runner, engine and the `dsv4` command line."""
