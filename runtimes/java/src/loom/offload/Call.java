package loom.offload;

/**
 * What a handler may ask about the call it is running, from the thread
 * running it.
 */
public final class Call {

    private static final ThreadLocal<long[]> CURRENT = new ThreadLocal<>();

    private Call() {
    }

    /** True once nobody waits for the current call's answer. */
    public static boolean cancelled() {
        long[] cur = CURRENT.get();
        return cur != null && cur[1] != 0 && Native.cancelled(cur[0], cur[1]);
    }

    /** The calling thread's {runtime, task} pair. */
    static long[] slot() {
        long[] cur = CURRENT.get();
        if (cur == null) {
            cur = new long[2];
            CURRENT.set(cur);
        }
        return cur;
    }
}
