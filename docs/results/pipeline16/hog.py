"""A competing process for compare_hog.sh: busy 30 ms, asleep 30 ms, until killed."""

import time

while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.03:
        pass
    time.sleep(0.03)
