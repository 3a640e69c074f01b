"""The example scenarios, installed as the package `keel.scenarios` (see keel/paths.py)."""
