package loom.example;

import loom.offload.Handler;

/** Returns what it is given. */
public final class Echo implements Handler {
    @Override
    public byte[] call(byte[] in) {
        return in;
    }
}
