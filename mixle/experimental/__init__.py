"""Experimental features."""
