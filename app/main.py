"""The keel dashboard: `keel app` (or `streamlit run app/main.py`). Pages are UI only; the
charts come from app/charts.py, the files from app/data.py."""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `streamlit run app/main.py` from anywhere
    sys.path.insert(0, str(_ROOT))

import streamlit as st  # noqa: E402

from app import ui  # noqa: E402

st.set_page_config(page_title="keel", page_icon=":material/sailing:", layout="wide")
ui.init_state()
page = st.navigation(ui.pages())
ui.sidebar()
page.run()
