"""Slowdowns (grey failures): a job that runs at the speed of one slow GPU or link."""
