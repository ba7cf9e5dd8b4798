"""Hydra search-path plugin: every Hydra app (verl's trainers included) finds the ``timeslice`` group.

Hydra imports the modules under the ``hydra_plugins`` namespace when an app starts; importing this
one also stores the section's schema (``timeslice_schema/base``, outside the group so it is never an option)
so options are validated at composition.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from timeslice_verl.config.overrides import conf_dir, register_schema

register_schema()


class TimesliceSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="timeslice-verl", path=f"file://{conf_dir()}")
