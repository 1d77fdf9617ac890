"""Compression scorers, dynamic selection, calibration, clustering and budget profiles."""
