package loom.offload;

/** The host's functions, registered by libloom_rt_java.so. */
final class Native {

    static final int TIMEDOUT = 0;
    static final long CLOSED = -1;

    static final int OK = 0;
    static final int ERROR = 1;

    static final int LOG_ERR = 4;
    static final int LOG_WARN = 5;

    private Native() {
    }

    /**
     * Answers the task slot[1] holds (unless 0) with OK and out, then
     * takes the next task into slot[1] (0 when none came in time, CLOSED
     * when closed) and returns its data, with its handler's name in
     * name[0]: left as it is when it names the same handler as the
     * thread's previous task, so name[0] belongs to this method.
     */
    static native byte[] next(long rt, long[] slot, byte[] out,
                              String[] name, int timeoutMs);

    static native boolean cancelled(long rt, long task);

    static native void answer(long rt, long task, int status, byte[] data);

    static native void log(long rt, int level, String msg);

    /** Called by each worker thread as it leaves. */
    static native void exited(long rt);
}
