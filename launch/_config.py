"""The launchers' one conversion: the `--config` flag's ConfigDict -> typed `Settings`."""

from absl import flags
from ml_collections import config_flags

from trackstar_jax import config as config_lib


def settings(holder: flags.FlagHolder) -> config_lib.Settings:
    """Typed settings of `--config` (errors name the key and the config file)."""
    return config_lib.from_configdict(holder.value, source=config_flags.get_config_filename(flags.FLAGS[holder.name]))
