"""Generation engines behind one interface; the policy actor hosts them in Ray actors."""
