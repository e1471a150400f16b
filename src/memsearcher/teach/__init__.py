"""How trajectories for SFT are made: the synthetic and Wikipedia oracles, the questions they
answer, the protocol data built from them (`memsearcher.teach.protocol_data`), and the shop's
teacher (`memsearcher.teach.shop`)."""
