"""The demo: a small CNN trained on scikit-learn's handwritten digits on several CPU workers."""
