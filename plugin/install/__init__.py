"""The host side: probe the host (:mod:`.probe`), decide per arm, build the plugin classes and rebind every
import site (:mod:`.installer`, :mod:`.rebind`). Loaded in every engine process; imports no tooling.
"""
