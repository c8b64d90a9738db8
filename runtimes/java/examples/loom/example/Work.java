package loom.example;

import java.security.MessageDigest;
import loom.offload.Call;
import loom.offload.StringHandler;

/**
 * "sha256 <rounds> <text>": hashes text rounds times (CPU work);
 * "sleep <ms>": sleeps, stopping early when the call is cancelled;
 * "hang <ms>": sleeps and never looks at cancellation (a stuck handler);
 * "fail <message>": throws; "null": returns null (an empty answer).
 */
public final class Work extends StringHandler {
    @Override
    public String call(String in) throws Exception {
        String[] p = in.split(" ", 3);
        switch (p[0]) {
        case "sha256": {
            MessageDigest md = MessageDigest.getInstance("SHA-256");
            byte[] h = p[2].getBytes("UTF-8");
            for (int i = Integer.parseInt(p[1]); i > 0; i--) {
                h = md.digest(h);
            }
            StringBuilder sb = new StringBuilder();
            for (byte b : h) {
                sb.append(String.format("%02x", b));
            }
            return sb.toString();
        }
        case "sleep": {
            long end = System.nanoTime() + Long.parseLong(p[1]) * 1000000L;
            while (System.nanoTime() < end) {
                if (Call.cancelled()) {
                    return "cancelled";
                }
                Thread.sleep(5);
            }
            return "slept";
        }
        case "hang":
            Thread.sleep(Long.parseLong(p[1]));
            return "hung";
        case "fail":
            throw new IllegalStateException(in.substring(4).trim());
        case "null":
            return null;
        default:
            throw new IllegalArgumentException("unknown op " + p[0]);
        }
    }
}
