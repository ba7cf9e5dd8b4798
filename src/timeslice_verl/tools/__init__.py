"""The node tools: the command line (``cli``), ``doctor`` and its container checks (``container``), the agent's
status as text (``status``) and the timeline's analysis and picture (``analysis``)."""
