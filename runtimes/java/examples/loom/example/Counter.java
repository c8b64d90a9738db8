package loom.example;

import java.util.concurrent.atomic.AtomicLong;
import loom.offload.StringHandler;

/**
 * State kept between calls: "<calls so far> <instances made>". One
 * instance serves every thread of a load.
 */
public final class Counter extends StringHandler {
    private static final AtomicLong INSTANCES = new AtomicLong();
    private final AtomicLong calls = new AtomicLong();

    public Counter() {
        INSTANCES.incrementAndGet();
    }

    @Override
    public String call(String in) {
        return calls.incrementAndGet() + " " + INSTANCES.get();
    }
}
