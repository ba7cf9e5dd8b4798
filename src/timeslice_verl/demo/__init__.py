"""``timeslice-verl demo``: the whole chain on one machine, with a fully-async-like trainer loop."""
