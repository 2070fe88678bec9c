"""Put ppo-fabric's config groups on Hydra's search path, so that a user's own primary config
(`--config-path DIR --config-name NAME`) can use them: `defaults: [config, override env: lunarlander]`."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class PpoFabricSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from ppo_fabric.config.values import config_dir  # a leaf module: omegaconf only

        search_path.append(provider="ppo-fabric", path=f"file://{config_dir()}")
