"""Where the tests find the repository: the root of `jaxreplay/`, `configs/`, `bench/`, `assets/`."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
