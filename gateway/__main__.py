import sys

from trajbus.gateway.server import main

sys.exit(main())
