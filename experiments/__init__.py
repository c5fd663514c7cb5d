"""Experiment drivers and studies: not part of the installed package.

Run from a checkout's root with the project's environment: `python -m experiments --help`.
"""
