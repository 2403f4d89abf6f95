"""Peer systems the performance suite compares against (bench.suite).

Each peer runs in its own virtual environment that the suite creates, from a script here that
imports nothing from this project: its inputs arrive as a JSON file, its results leave as one.
"""
