"""Everything that crosses a process boundary we own (router <-> workers), msgspec-encoded."""
