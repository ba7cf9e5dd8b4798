"""The ``timeslice`` section: its structured schema and validation (``schema``) and its composition outside verl
in the trainer's override syntax (``overrides``)."""
