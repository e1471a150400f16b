"""Bridges to other training engines. Each lives in its own subpackage and imports its engine
lazily, so that memsearcher installs and imports without them."""
