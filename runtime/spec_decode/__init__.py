from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.speculator import Speculator

__all__ = ["SpeculativeConfig", "Speculator"]
