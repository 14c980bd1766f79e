"""Shipped A/B profiles (YAML). ``fdsched profiles`` lists them; ``FDSCHED_PROFILE=<name>`` selects one."""
