import warnings

# transformers 5.x warns on every `past_key_values=`; the tests use that spelling on purpose.
warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated", category=FutureWarning)
