"""A server that never serves (tests of the start's heartbeat and deadline): prints one line of
progress, then sleeps. SGLang's server flags are accepted and ignored."""

import time

if __name__ == "__main__":
    print("loading weights: shard 3 of 7", flush=True)
    time.sleep(120)
