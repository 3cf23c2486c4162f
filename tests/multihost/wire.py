"""A slow, lossy Ethernet wire between two TAP devices, in user space (for kernels without ``tc netem``).

``python wire.py TAP_A TAP_B --delay-ms 20 --jitter-ms 5 --loss 0.01 --seed 0`` creates both TAP devices,
prints ``ready`` and then forwards every frame from one to the other after ``delay ± jitter`` ms (uniform;
frames may overtake each other, as with netem's jitter), dropping each with probability ``loss``. The
caller moves the devices into their network namespaces; the wire runs until it is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import os
import random
import select
import struct
import sys
import time

TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("taps", nargs=2)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=5.0)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    fds = [open_tap(name) for name in args.taps]
    other = {fds[0]: fds[1], fds[1]: fds[0]}
    rng = random.Random(args.seed)
    queue: list[tuple[float, int, int, bytes]] = []  # (due, order, destination, frame)
    order = 0
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        wait = max(0.0, queue[0][0] - now) if queue else 1.0
        readable, _, _ = select.select(fds, [], [], wait)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if rng.random() < args.loss:
                    continue
                delay = (args.delay_ms + rng.uniform(-args.jitter_ms, args.jitter_ms)) / 1000
                heapq.heappush(queue, (now + delay, order, other[fd], frame))
                order += 1
        while queue and queue[0][0] <= now:
            _, _, fd, frame = heapq.heappop(queue)
            with contextlib.suppress(OSError):  # the device is down: the frame is lost, as on a cut wire
                os.write(fd, frame)


if __name__ == "__main__":
    sys.exit(main())
