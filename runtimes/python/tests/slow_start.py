"""A handler module whose import takes a second (tests: start-up runs off
the nginx event loop; calls made meanwhile wait in the queue)."""

import time

import loom

time.sleep(1.0)
loom.log(loom.LOG_NOTICE, "slow_start imported")


def handle(payload):
    return b"started:" + payload
