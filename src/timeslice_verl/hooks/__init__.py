"""The hook framework: the lifecycle hookspec (``spec``), the frozen records hooks receive (``events``), the
plugin manager (``manager``), the dispatcher with its typed facade (``lifecycle``) and the generated reference
(``reference``). ``events`` is plain data that every layer may read; the rest needs pluggy."""
