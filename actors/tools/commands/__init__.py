"""The ``parkway`` commands, one module per group of commands that share a job.

Each command has an ``add_<command>(subcommands)`` function that adds its parser and sets its handler;
``parkway.actors.tools.cli`` calls them in the order ``parkway --help`` lists them.
"""
