import sys

from ranks.config import RankConfig
from ranks.worker import main

sys.exit(main(RankConfig.from_argv()))
