import sys

from orbit.http.server import main

sys.exit(main())
