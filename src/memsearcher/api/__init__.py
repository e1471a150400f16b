"""The agent behind an HTTP API (``memsearcher serve``); see :mod:`memsearcher.api.app`."""
