"""What the suite asks of the machine's process tools, asked here once (not through the code under test)."""

from __future__ import annotations

import shutil
import subprocess

# util-linux's setpriv that takes --pdeathsig (2.33 or newer): what pgwcore.server.bound_to_parent needs to
# bind a child to its parent. Asked directly, so a bound_to_parent that binds nothing fails its tests.
PDEATHSIG = shutil.which("setpriv") is not None and subprocess.run(
    ["setpriv", "--pdeathsig", "TERM", "--", "true"], check=False, capture_output=True).returncode == 0
NO_PDEATHSIG = "no util-linux setpriv that takes --pdeathsig (2.33 or newer): children are not bound to their parent"
